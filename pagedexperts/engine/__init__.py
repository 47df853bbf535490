"""The engine: generation requests batched continuously on one thread, apart from HTTP (docs/design.md
"Generation, engine, serving"). Does not speak HTTP (``pagedexperts.serving``) or page experts
(``pagedexperts.paging``). Needs torch only.
"""
