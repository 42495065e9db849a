"""Exact speculative decoding: the decoder, the token tree of drafts laid out as one verify batch,
and the draft controller."""
