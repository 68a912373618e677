"""dptrain against its peers: alternated whole runs (throughput), interleaved blocks in the same ranks
(interleaved), one step per operator (op_profile); the peer itself is peer.py."""
