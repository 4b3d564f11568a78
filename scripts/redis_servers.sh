#!/usr/bin/env bash
# Real Redis servers for the remote tier's tests: one standalone server and a three-node
# cluster on free loopback ports, from Debian's redis-server (installed if missing, as root).
#   bash scripts/redis_servers.sh start DIR   # prints the KVTIER_TEST_REDIS* exports
#   bash scripts/redis_servers.sh stop DIR
set -euo pipefail
cmd=$1 dir=$2
free_port() {  # a free port whose cluster bus port (+10000) is free too
  python3 - <<'PY'
import random, socket
for _ in range(1000):
    p = random.randint(20000, 45000)
    try:
        for q in (p, p + 10000):
            socket.create_server(("127.0.0.1", q)).close()
    except OSError:
        continue
    print(p)
    break
PY
}
start_one() {  # port, extra redis-server args...
  local port=$1; shift
  mkdir -p "$dir/$port"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$dir/$port" --daemonize yes \
    --pidfile "$dir/$port/redis.pid" --logfile "$dir/$port/redis.log" --save '' \
    --appendonly no "$@"
  for _ in $(seq 100); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "redis-server on port $port did not start: $(tail -5 "$dir/$port/redis.log")" >&2
  exit 1
}
case $cmd in
  start)
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
      apt-get update -q >/dev/null && apt-get install -y -q redis-server redis-tools >/dev/null
    fi
    mkdir -p "$dir"
    solo=$(free_port)
    start_one "$solo" --maxmemory 256mb --maxmemory-policy allkeys-lru
    nodes=()
    for _ in 1 2 3; do
      p=$(free_port)
      start_one "$p" --cluster-enabled yes --cluster-config-file "$dir/$p/nodes.conf" \
        --cluster-node-timeout 2000
      nodes+=("127.0.0.1:$p")
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$dir/cluster.log"
    for _ in $(seq 100); do
      redis-cli -p "${nodes[0]#*:}" cluster info | grep -q 'cluster_state:ok' && break
      sleep 0.1
    done
    echo "export KVTIER_TEST_REDIS=127.0.0.1:$solo"
    echo "export KVTIER_TEST_REDIS_CLUSTER=$(IFS=,; echo "${nodes[*]}")"
    ;;
  stop)
    # SIGTERM, then wait for each server to exit: a server still shutting down writes its log
    # and nodes.conf, and removing DIR under it fails ("Directory not empty").
    pids=()
    for pidfile in "$dir"/*/redis.pid; do
      [ -f "$pidfile" ] || continue
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null && pids+=("$pid")
    done
    for pid in "${pids[@]}"; do
      for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -9 "$pid" 2>/dev/null || true
    done
    ;;
esac
