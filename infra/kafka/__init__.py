"""Kafka I/O, the client side: typed producers and consumers, reads, keys, the topic catalogue and its docs,
run records, processor snapshots, record signatures, consumer lag, and the clients' security settings.
"""
