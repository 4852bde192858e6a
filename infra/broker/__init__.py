"""The embedded Kafka broker: assembled from Maven Central jars (``kafka/pom.xml``), started with ``java``,
and its security (a private CA, SCRAM users, ACLs derived from the topic catalogue).
"""
