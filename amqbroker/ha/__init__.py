"""High availability: a backup per node id, and the ZooKeeper lease that picks the live one."""
