"""The paged KV state of one rank: its layout arithmetic (`layout`: what a model family's
KV costs, how a budget splits into pages), the pools in one arena (`pool`, on memory from
`memory`), the refcounted page allocator (`allocator`) and the staging blocks a held request
waits in (`staging`). What is cached across requests is engine.prefix_cache's."""
