"""The decode worker: pulls a prefilled request's KV over NIXL and streams its tokens."""
