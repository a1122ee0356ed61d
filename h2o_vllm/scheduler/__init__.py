"""Engine-core side of H2O: block accounting in KV space. Never touches a tensor."""
