"""What the search tool's client and the tool servers agree on: its description and the request limits."""

SEARCH_DESCRIPTION = "search the document collection; the query is a short keyword query, results are passages"
# the retrieval server's default request limits (rlsearch serve-retriever --max-topk, --max-queries, --max-query-chars)
MAX_TOPK = 100
MAX_QUERIES = 512  # queries per request; the client's batch_size is capped to it
MAX_QUERY_CHARS = 4096
