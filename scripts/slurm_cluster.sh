#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for the integration tests and for trying the launcher:
#   bash scripts/slurm_cluster.sh up       install (apt, root) munge + slurmctld + slurmd + clients when missing,
#                                          write slurm.conf, start the daemons, wait until the node is idle
#   bash scripts/slurm_cluster.sh down     stop them cleanly (scontrol shutdown, then munged)
#   bash scripts/slurm_cluster.sh status   print the node state; exit 0 when the cluster takes jobs, 1 otherwise
# Idempotent: `up` on a running cluster and `down` on a stopped one do nothing. Works without systemd (daemons are
# started directly). The node declares CPUS (default 8) CPUs whatever the machine has (SlurmdParameters=
# config_overrides) and OverSubscribe=FORCE:4 lets jobs share them, so several multi-process jobs fit on 2 cores.
# Everything Slurm writes (state, spool, logs, pid files) lives in MEGALOOP_SLURM_DIR (default
# /var/tmp/megaloop-slurm); /etc/slurm/slurm.conf is a link to the slurm.conf there (an existing slurm.conf that
# this script did not write is never replaced: the script stops with a message instead).
set -euo pipefail

DIR=${MEGALOOP_SLURM_DIR:-/var/tmp/megaloop-slurm}
CPUS=${MEGALOOP_SLURM_CPUS:-8}
ETC_CONF=/etc/slurm/slurm.conf
MARK="# written by megaloop scripts/slurm_cluster.sh"
NODE=$(hostname -s)

say() { echo "[slurm-cluster] $*"; }
die() { echo "[slurm-cluster] error: $*" >&2; exit 1; }

install_packages() {
  local missing=()
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; run as root to install them with apt"
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
  say "installing ${missing[*]} (apt)"
  # Debian's maintainer scripts try to start the services; without systemd that fails harmlessly
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  cat >"$DIR/slurm.conf" <<EOF
$MARK
ClusterName=megaloop
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
MinJobAge=600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  mkdir -p /etc/slurm
  if [ -e "$ETC_CONF" ] || [ -L "$ETC_CONF" ]; then
    if [ "$(readlink -f "$ETC_CONF")" != "$(readlink -f "$DIR/slurm.conf")" ] && ! grep -qF "$MARK" "$ETC_CONF"; then
      die "$ETC_CONF exists and was not written by this script; move it away to use the local test cluster"
    fi
  fi
  ln -sfn "$DIR/slurm.conf" "$ETC_CONF"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_ok && return 0
  [ -s /etc/munge/munge.key ] || { [ -x /usr/sbin/mungekey ] && /usr/sbin/mungekey --create >/dev/null 2>&1; } ||
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  # a daemon that died without cleaning up leaves its socket and pid file behind: --force reuses them
  runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do munge_ok && return 0; sleep 0.1; done
  die "munged does not answer (see /var/log/munge/munged.log)"
}

# the node's state as sinfo prints it (idle, mixed, allocated, down*, ...), or nothing when slurmctld does not answer
node_state() { timeout 10 sinfo -h -N -o %T 2>/dev/null | head -n1 || true; }

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$(cat "$1")/status" 2>/dev/null; }

up() {
  install_packages
  write_conf
  start_munge
  pid_alive "$DIR/run/slurmctld.pid" || { say "starting slurmctld"; slurmctld; }
  pid_alive "$DIR/run/slurmd.pid" || { say "starting slurmd"; slurmd; }
  local state=""
  for _ in $(seq 120); do
    state=$(node_state)
    case "$state" in
      idle|mixed|allocated|completing) say "up: node $NODE $state ($CPUS CPUs, partition debug)"; return 0 ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  die "the node did not become idle within 60 s (state: ${state:-no answer}); logs above"
}

down() {
  if [ -n "$(node_state)" ]; then
    say "stopping slurmctld and slurmd (scontrol shutdown)"
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  for _ in $(seq 100); do
    pid_alive "$DIR/run/slurmctld.pid" || pid_alive "$DIR/run/slurmd.pid" || break
    sleep 0.2
  done
  for f in "$DIR/run/slurmd.pid" "$DIR/run/slurmctld.pid"; do  # still there after 20 s: stop them by their pid
    if pid_alive "$f"; then kill "$(cat "$f")" 2>/dev/null || true; fi
  done
  if munge_ok; then
    say "stopping munged"
    /usr/sbin/munged --stop >/dev/null 2>&1 || true
  fi
  say "down"
}

status() {
  local state
  state=$(node_state)
  if munge_ok; then say "munge: ok"; else say "munge: not running"; fi
  if [ -z "$state" ]; then say "slurmctld: not answering"; return 1; fi
  timeout 10 sinfo
  case "$state" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  -h|--help|help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "usage: bash scripts/slurm_cluster.sh up|down|status" >&2; exit 2 ;;
esac
