"""The paged KV state of one rank: its layout arithmetic (`layout`: what a model family's
KV costs, how a budget splits into pages), the pools in one arena (`pool`), the refcounted page
allocator (`allocator`) and the staging blocks a held request waits in (`staging`)."""
