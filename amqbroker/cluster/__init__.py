"""Clustering (issue 15): peer connections, store-and-forward and clustered grouping.

Layer: between app and net. It may import net, protocol, settings, core; it never
imports proton (the protocol layer's `peer` module speaks AMQP for it). `node` is the
cluster node, the runner that wires `topology` (peers, links, announcements),
`routing` (the routing hook, group bindings), `proposals` (a group key's state
machine on its entry node), `node_loss` (lost peers, recovered groups, consumerless
release) and `management` (the cluster's management handlers); `arbiter` the LOCAL
grouping handler and the role interface a leader election drives, `decisions` the
arbiter's synced decision log, `election` the ZooKeeper election and its epoch
fence, `replication` the synchronous copy of every decision to the backup arbiter.
"""
