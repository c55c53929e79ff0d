"""attn-backends-contracts: the conformance suite any attention backend must pass."""
