"""Service discovery behind one small interface (register, deregister, resolve,
watch). Backends: static addresses (one machine), etcd (leases), Consul."""
