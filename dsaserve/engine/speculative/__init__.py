"""Speculative decoding with the checkpoint's MTP layer: the flag (`config`, torch-free), the
draft and verify steps (`steps`), acceptance (`verify`: greedy and rejection sampling), the
counters (`stats`) and the adaptive choice of drafts per step (`adaptive`)."""
