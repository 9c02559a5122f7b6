"""The test bed: local Kafka brokers (``kafka_cluster``), proxy node processes (``proxies``),
the local fleet launcher (``fleet``) and process control (``process``)."""

KAFKA_BASE_PORT = 19092  # broker i listens on base+i-1, its controller on base+100+i-1
