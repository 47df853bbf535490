"""Generation: text generation on a paged model, with timing and the paging report."""
