#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for CI and the Slurm tests.
#
#   .ci/slurm-cluster.sh start    install (Debian packages) if needed, write /etc/slurm/slurm.conf,
#                                 start munged, slurmctld, `slurmd -N node1` and `slurmd -N node2`,
#                                 and wait until both nodes are idle
#   .ci/slurm-cluster.sh stop     cancel every job, stop the four daemons by the PIDs in their
#                                 pidfiles, remove the slurm.conf this script wrote, and fail if
#                                 any daemon is still running
#   .ci/slurm-cluster.sh status   exit 0 when the cluster answers and both nodes are up
#
# Both nodes are this host (NodeAddr 127.0.0.1, one slurmd port each); Debian's build runs
# several slurmd on one host. No cgroups (proctrack/linuxproc, task/none) and no slurmdbd, so
# `sacct` fails: the Snakemake executor must poll with `squeue`, which works because MinJobAge
# keeps finished jobs visible far longer than its first status check. The config lives at
# /etc/slurm/slurm.conf because the executor's job steps drop SLURM_CONF from the environment.
# `stop` removes it again: a config naming a controller that no longer runs makes every Slurm
# client wait for it (`scontrol show config`: 9 s), and the Snakemake Slurm executor plugin runs
# that command when it is imported, at every `snakemake` start, whatever the executor.
# (RL_ENGINE_SLURM_CONF and RL_ENGINE_MUNGE_PID move both files, for tests/test_slurm_script.py.)
set -euo pipefail

STATE=${RL_ENGINE_SLURM_STATE:-/var/tmp/rl-engine-slurm}
CONF=${RL_ENGINE_SLURM_CONF:-/etc/slurm/slurm.conf}
CONF_MARKER="# Written by .ci/slurm-cluster.sh"
CTLD_PORT=${RL_ENGINE_SLURM_PORT:-16817}
NODES=(node1 node2)
NODE_CPUS=${RL_ENGINE_SLURM_CPUS:-8}
MUNGE_SOCKET=/run/munge/munge.socket.2
MUNGE_PID=${RL_ENGINE_MUNGE_PID:-/run/munge/munged.pid}

log() { echo "slurm-cluster: $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    log "installing slurmctld slurmd slurm-client munge (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
    mkdir -p "$(dirname "$CONF")" "$STATE/ctld" "$STATE/log"
    for node in "${NODES[@]}"; do mkdir -p "$STATE/$node"; done
    local port=$((CTLD_PORT + 1)) node_lines=""
    for node in "${NODES[@]}"; do
        node_lines+="NodeName=$node NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$port CPUs=$NODE_CPUS RealMemory=64000 State=UNKNOWN"$'\n'
        port=$((port + 1))
    done
    cat >"$CONF" <<EOF
$CONF_MARKER: two slurmd (node1, node2) on this one host.
ClusterName=rlengine
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=900
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
$node_lines
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

pid_of() {  # the live PID recorded in a pidfile, or nothing
    local file=$1 pid
    [ -s "$file" ] || return 0
    pid=$(tr -dc 0-9 <"$file")
    # a killed daemon stays a zombie until init reaps it: kill -0 succeeds on it, but it is not live
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(ps -o stat= -p "$pid" | cut -c1)" != Z ]; then
        echo "$pid"
    fi
}

pidfiles() { echo "$STATE/slurmd-node2.pid $STATE/slurmd-node1.pid $STATE/slurmctld.pid $MUNGE_PID"; }

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    for node in "${NODES[@]}"; do
        grep -Eq "^$node (idle|mix|alloc)-?$" <<<"$states" || return 1  # not idle* (not responding); "-": planned by backfill
    done
}

start() {
    install_packages
    if nodes_idle; then log "already running"; return; fi
    write_conf
    mkdir -p /run/munge && chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create >/dev/null; chown munge:munge /etc/munge/munge.key; }
    if [ -z "$(pid_of "$MUNGE_PID")" ]; then
        runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID" --socket="$MUNGE_SOCKET"
    fi
    if [ -z "$(pid_of "$STATE/slurmctld.pid")" ]; then
        slurmctld -c   # -c: a clean start, no job state from an earlier cluster
    fi
    for node in "${NODES[@]}"; do
        if [ -z "$(pid_of "$STATE/slurmd-$node.pid")" ]; then slurmd -N "$node"; fi
    done
    for _ in $(seq 1 60); do
        if nodes_idle; then
            scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME >/dev/null 2>&1 || true
            log "up: $(sinfo -h -N -o '%N=%t' | tr '\n' ' ')"
            return
        fi
        sleep 0.5
    done
    log "nodes did not come up; see $STATE/log/"
    sinfo -N >&2 || true
    tail -n 20 "$STATE"/log/*.log >&2 || true
    exit 1
}

stop() {
    if [ -n "$(pid_of "$STATE/slurmctld.pid")" ]; then
        scancel --full --state=PENDING,RUNNING -u "$(id -un)" 2>/dev/null || true
        scancel -u "$(id -un)" 2>/dev/null || true
    fi
    local pids=() pid
    for file in $(pidfiles); do
        pid=$(pid_of "$file")
        if [ -n "$pid" ]; then pids+=("$pid"); kill -TERM "$pid"; fi
    done
    for _ in $(seq 1 100); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && break
        sleep 0.1
    done
    local left=()
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; left+=("$pid"); fi
    done
    for file in $(pidfiles); do rm -f "$file"; done
    # only a config this script wrote (its first line says so); another one is the machine's own
    if [ -f "$CONF" ] && head -n 1 "$CONF" | grep -qF "$CONF_MARKER"; then rm -f "$CONF"; fi
    # job steps (slurmstepd) end with their jobs; one still running after the daemons is a leak
    for _ in $(seq 1 100); do
        pgrep -x slurmstepd >/dev/null || break
        sleep 0.1
    done
    if pgrep -x slurmstepd >/dev/null; then
        log "job step daemons still running: $(pgrep -a -x slurmstepd | tr '\n' ' ')"
        exit 1
    fi
    if [ "${#left[@]}" -gt 0 ]; then
        log "killed daemons that ignored SIGTERM: ${left[*]}"
        exit 1
    fi
    log "stopped (${#pids[@]} daemons)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) nodes_idle ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
