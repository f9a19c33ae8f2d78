#!/bin/sh
# One-shot ACL bootstrap of the compose mesh's Consul (the `consul-acl` service), idempotent.
# Consul runs with ACLs on and default_policy "deny" (consul/acl.json): an unknown or missing
# token can neither register nor read (https://developer.hashicorp.com/consul/docs/security/acl).
# This script:
#   1. bootstraps the ACL system once (`consul acl bootstrap`) and keeps the management
#      token in the tokens volume, readable by root only (this container);
#   2. gives the agent a token of its own (node writes; persisted by enable_token_persistence);
#   3. makes one policy and one token per llmesh service: write on its own service name,
#      read on the others (to resolve them), and writes the token to /tokens/<service>.token,
#      owned by the llmesh user (10001), mode 0400. Each service reads its own file into
#      LLMESH_CONSUL_TOKEN when it starts.
# Tokens that exist are kept. Lost the volume but not Consul's data? `docker compose down -v`
# resets both.
set -eu
umask 077
TOKENS=/tokens
SERVICES="gateway scheduler modelmgr cache engine"

secret_of() { awk '/^SecretID:/ {print $2}'; }

if [ ! -s "$TOKENS/management.token" ]; then
  tries=0
  # The agent has a leader (its healthcheck) but the ACL system may still be starting.
  until out=$(consul acl bootstrap 2>&1); do
    case "$out" in
      *"no longer allowed"*)
        echo "consul-acl: Consul is bootstrapped but $TOKENS/management.token is gone; reset with 'docker compose down -v'" >&2
        exit 1 ;;
    esac
    tries=$((tries + 1))
    [ "$tries" -lt 30 ] || { echo "consul-acl: consul acl bootstrap failed: $out" >&2; exit 1; }
    sleep 2
  done
  echo "$out" | secret_of > "$TOKENS/management.token"
fi
CONSUL_HTTP_TOKEN=$(cat "$TOKENS/management.token")
export CONSUL_HTTP_TOKEN

policy() {  # name rules
  consul acl policy read -name "$1" >/dev/null 2>&1 || consul acl policy create -name "$1" -rules "$2" >/dev/null
}

if [ ! -s "$TOKENS/agent.token" ]; then
  policy llmesh-agent 'node_prefix "" { policy = "write" } service_prefix "" { policy = "read" }'
  consul acl token create -description "consul agent" -policy-name llmesh-agent | secret_of > "$TOKENS/agent.token"
fi
consul acl set-agent-token agent "$(cat "$TOKENS/agent.token")" >/dev/null

for svc in $SERVICES; do
  if [ ! -s "$TOKENS/$svc.token" ]; then
    policy "llmesh-$svc" "service \"$svc\" { policy = \"write\" } service_prefix \"\" { policy = \"read\" } node_prefix \"\" { policy = \"read\" }"
    consul acl token create -description "llmesh $svc" -policy-name "llmesh-$svc" | secret_of > "$TOKENS/$svc.token"
  fi
  chown 10001:10001 "$TOKENS/$svc.token"
  chmod 0400 "$TOKENS/$svc.token"
done
echo "consul-acl: tokens ready for $SERVICES"
