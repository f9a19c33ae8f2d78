"""Live configuration: one typed, validated document that services apply without a
restart. Backends: a YAML file (one machine) or etcd (production), both watched."""
