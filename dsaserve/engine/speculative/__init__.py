"""Speculative decoding with the checkpoint's own draft head (its MTP layer, or a DSpark head):
the flag (`config`, torch-free), which head a checkpoint carries (`dspark_spec`, torch-free;
`draft_head`), the step around the target's forward (`speculator`), each head's drafts
(`mtp_drafter`, `dspark_drafter`), acceptance (`verify`: greedy and rejection sampling), the
counters (`stats`) and how many drafts a step verifies (`adaptive`).

The draft head's layers are layers of the pools (`draft_layers`): their window rings, compressed
pages and compressor rings are allocated, preempted, transferred, checkpointed and freed with the
request's, and the layout hash names them (`mtp_layer_types`, `draft_head`), so a speculating
worker pairs only with one that speculates alike. A prefill worker drafts after the first token
as one engine does after a prefill; the drafts (and DSpark's confidences) ride in the KV handle
(`KVHandle.draft_token_ids`: at most K ids in the vocabulary, else engine.handoff's `reserve`
refuses them), so the decode worker verifies from its first step and speculates as the request
never moved would. A speculating engine waits for each step (no async scheduling: the accepted
count decides where the next step starts) and runs decode steps eagerly (engine.rank: no CUDA
graphs).
"""
