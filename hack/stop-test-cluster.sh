#!/usr/bin/env bash
# Stops what hack/start-test-cluster.sh started, newest first, by recorded PID, and removes WORK_DIR.
# Each component gets SIGTERM and up to 15 s to exit (kube-apiserver needs etcd while it shuts down,
# so etcd goes last), then SIGKILL.
#   bash hack/stop-test-cluster.sh WORK_DIR [--keep]
set -uo pipefail
W=${1:?usage: $0 WORK_DIR [--keep]}
# Resolved once against the caller's directory (-s: a link given as WORK_DIR is removed, not its target).
W=$(realpath -ms -- "$W")
if [[ -f "$W/pids" ]]; then
  while read -r pid name; do
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 75); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null
      echo "killed $name ($pid): it ignored SIGTERM for 15s"
    else
      echo "stopped $name ($pid)"
    fi
  done < <(tac "$W/pids")
fi
[[ "${2:-}" == "--keep" ]] || rm -rf "$W"
