"""Everything that touches PySyncObj: a durable journal and a hardened Raft member."""
