"""Parts of tools/record_peer_mismatch.py: peer-source loading, inputs, one module per peer."""
