"""The gateway's pure domain logic: routing policy, token counting, tenant limits and
quota arithmetic, the PII and prompt-injection guards. No gRPC, no transport
framework: plain inputs in, plain values out; stages and adapters call them."""
