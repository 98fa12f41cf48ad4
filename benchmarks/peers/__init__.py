"""The brokers quorumq is compared with, each as 3 server processes on loopback.

`rabbitmq.RabbitCluster` / `RabbitSystem`: RabbitMQ nodes clustered by hand, a quorum
queue, the pika client. `jetstream.NatsCluster` / `NatsSystem`: nats-server processes in
one JetStream cluster, an R3 file stream, the nats-py client. `common`: message bodies,
process accounting, producer processes and the analysis of a paced run.
"""
