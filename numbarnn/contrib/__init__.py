"""Cells built only through the public API (`numbarnn.cells.CellSpec` + `register`), one file each.

Importing a module registers its cell; afterwards its name works as an rnn_mode everywhere:

    import numbarnn.contrib.peephole_lstm        # rnn_mode="peephole_lstm"
    import numbarnn.contrib.cifg_lstm            # rnn_mode="cifg_lstm"
    import numbarnn.contrib.indrnn               # rnn_mode="indrnn" (haste's, tanh) and "indrnn_relu"
    import numbarnn.contrib.gru_v1               # rnn_mode="gru_v1" (the classic GRU: reset before R_n)
    import numbarnn.contrib.mgu                  # rnn_mode="mgu" (the minimal gated unit)
    import numbarnn.contrib.layer_norm_lstm      # rnn_mode="layer_norm_lstm" (haste's LayerNormLSTM)
    import numbarnn.contrib.layer_norm_gru       # rnn_mode="layer_norm_gru" (haste's LayerNormGRU)
    numbarnn check --cells numbarnn.contrib.cifg_lstm --mode cifg_lstm
"""
