"""`dsaserve profile`: where a decode step's time goes, and how far it is from its floors.

    history       synthetic requests with T tokens of context already in the KV cache, written
                  as a disaggregated transfer writes them (reserve, fill the pages, join)
    capture       decode steps under torch.profiler -> CPU ops, device kernels, range spans
    attribution   each op / kernel -> (model part, kernel class), the rest of the step -> host
    floors        the least bytes and FLOPs of a decode step per (part, class), from the model's
                  shapes and the pool's layout; their time on a device
    hardware      copy bandwidth and matmul rates: recorded for the H200, else measured
    report        the table and the JSON
    decode        all of it around a step function (`profile_decode`) or an LLMEngine
                  (`profile_engine`)

The part names are the ranges of engine.profile.ranges, which the model and the engine's step
open. Modules are imported by name (`from dsaserve.engine.profile.decode import
profile_engine`); this package's __init__ imports nothing, so the model can import the ranges
without a cycle.
"""
