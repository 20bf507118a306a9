#!/usr/bin/env bash
# A real single-node Slurm on this machine, for tests and CI (recipe: ../shared/notes/slurm-local.md).
#
#   bash tools/slurm_local.sh up       # install if missing, start munged + slurmctld + slurmd, wait until idle
#   bash tools/slurm_local.sh status   # which daemons run, who started them, sinfo
#   bash tools/slurm_local.sh down     # stop ONLY the daemons `up` started, by PID, in reverse order
#
# Idempotent: `up` starts only the daemons that are not running and records each one it starts
# (PID) under $SLURM_LOCAL_STATE (default /run/slurm-local); `down` stops exactly those, waits for
# them to exit and removes their PID files (a stale slurmctld pid file breaks a later package removal).
# Daemons that were already running (someone else's) are left alone. Needs root (Debian 12 packages).
#
# Environment: SLURM_LOCAL_STATE (state dir), SLURM_LOCAL_TIMEOUT (seconds to wait for `idle`, 60),
# SLURM_LOCAL_PARTITION (debug).
set -euo pipefail

STATE=${SLURM_LOCAL_STATE:-/run/slurm-local}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
PARTITION=${SLURM_LOCAL_PARTITION:-debug}
CONF=/etc/slurm/slurm.conf
MARK="# written by megatron-dapo tools/slurm_local.sh"
# daemon name -> pid file (the order is the start order; down goes in reverse)
DAEMONS=(munged slurmctld slurmd)
declare -A PIDFILE=([munged]=/run/munge/munged.pid [slurmctld]=/run/slurmctld.pid [slurmd]=/run/slurmd.pid)

say() { echo "[slurm_local] $*"; }
die() { echo "[slurm_local] error: $*" >&2; exit 1; }

# A PID from a file if that process is alive and is the named daemon.
live_pid() {  # name pidfile
  local pid
  [ -f "$2" ] || return 1
  pid=$(tr -dc '0-9' <"$2")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  echo "$pid"
}

install_packages() {
  local missing=0
  for bin in /usr/sbin/munged /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sinfo /usr/bin/sbatch; do
    [ -x "$bin" ] || missing=1
  done
  [ "$missing" = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "Slurm/munge are not installed and installing needs root"
  say "installing slurmctld slurmd slurm-client munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # policy-rc.d may print "denied execution of start": harmless, the daemons are started below.
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 700 /etc/munge
    if command -v mungekey >/dev/null; then mungekey -c -f -k /etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 755 /run/munge
  start_daemon munged runuser -u munge -- /usr/sbin/munged
  munge -n | unmunge >/dev/null || die "munge does not work (munge -n | unmunge failed)"
}

# Start a daemon unless it already runs; record the PID of one we started.
start_daemon() {  # name command...
  local name=$1 pf=${PIDFILE[$1]} pid i
  shift
  if pid=$(live_pid "$name" "$pf"); then
    say "$name already running (pid $pid)$( [ -f "$STATE/$name.pid" ] && echo ', started by us' || echo ', not ours: left alone by down')"
    return 0
  fi
  rm -f "$pf"
  "$@" || die "$name failed to start (see /var/log/slurm or syslog)"
  for i in $(seq 1 100); do  # daemonizes: wait for its pid file
    pid=$(live_pid "$name" "$pf") && break
    sleep 0.1
  done
  [ -n "${pid:-}" ] || die "$name did not write a live pid to $pf"
  echo "$pid" >"$STATE/$name.pid"
  say "started $name (pid $pid)"
}

ensure_hostname() {
  local host
  host=$(hostname -s)
  getent hosts "$host" >/dev/null || { echo "127.0.0.1 $host" >>/etc/hosts; say "added $host to /etc/hosts"; }
}

write_conf() {
  local host node mem_mb tmp
  host=$(hostname -s)
  # the node line as slurmd sees the hardware, without RealMemory (set below, with headroom)
  node=$(/usr/sbin/slurmd -C | head -n1 | sed -E 's/ RealMemory=[0-9]+//')
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.85}' /proc/meminfo)
  install -d -o slurm -g slurm /var/spool/slurmctld /var/log/slurm
  install -d /var/spool/slurmd /etc/slurm
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
$MARK
ClusterName=ci
SlurmctldHost=localhost
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
EnforcePartLimits=ALL
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
KillWait=5
MinJobAge=300
InactiveLimit=0
$node NodeAddr=127.0.0.1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  if [ -f "$CONF" ] && cmp -s "$tmp" "$CONF"; then rm -f "$tmp"; return 0; fi
  if [ -f "$CONF" ] && ! grep -qxF "$MARK" "$CONF"; then
    cp -p "$CONF" "$CONF.bak.$(date +%s)"
    say "kept the previous $CONF as $CONF.bak.*"
  fi
  install -m 644 "$tmp" "$CONF"
  rm -f "$tmp"
  say "wrote $CONF ($node)"
}

wait_idle() {
  local host state deadline
  host=$(hostname -s)
  deadline=$((SECONDS + TIMEOUT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -n1 || true)
    case "$state" in
      idle|mixed|allocated|completing) say "node $host is $state"; return 0 ;;
      down*|drain*|fail*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node $host not idle after ${TIMEOUT}s (state: ${state:-no answer}); see /var/log/slurm/*.log"
}

up() {
  [ "$(id -u)" = 0 ] || die "up needs root"
  local t0=$SECONDS
  install -d -m 755 "$STATE"
  install_packages
  start_munge
  ensure_hostname
  write_conf
  start_daemon slurmctld /usr/sbin/slurmctld
  start_daemon slurmd /usr/sbin/slurmd
  wait_idle
  say "up in $((SECONDS - t0)) s"
}

stop_pid() {  # name pid pidfile
  local i
  kill -TERM "$2" 2>/dev/null || true
  for i in $(seq 1 150); do
    kill -0 "$2" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$2" 2>/dev/null; then
    say "$1 (pid $2) ignored TERM for 30 s: KILL"
    kill -KILL "$2" 2>/dev/null || true
  fi
  rm -f "$3"
  say "stopped $1 (pid $2)"
}

down() {
  local i name recorded pid
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    name=${DAEMONS[i]}
    [ -f "$STATE/$name.pid" ] || continue
    recorded=$(tr -dc '0-9' <"$STATE/$name.pid")
    if pid=$(live_pid "$name" "${PIDFILE[$name]}") && [ "$pid" = "$recorded" ]; then
      stop_pid "$name" "$pid" "${PIDFILE[$name]}"
    elif [ -n "$recorded" ] && kill -0 "$recorded" 2>/dev/null \
        && [ "$(cat "/proc/$recorded/comm" 2>/dev/null)" = "$name" ]; then
      stop_pid "$name" "$recorded" "${PIDFILE[$name]}"
    else
      say "$name (pid ${recorded:-?}) is no longer running"
      # remove the pid file only when it names a dead process (never someone else's live daemon)
      live_pid "$name" "${PIDFILE[$name]}" >/dev/null || rm -f "${PIDFILE[$name]}"
    fi
    rm -f "$STATE/$name.pid"
  done
}

status() {
  local name pid owner rc=0
  for name in "${DAEMONS[@]}"; do
    if pid=$(live_pid "$name" "${PIDFILE[$name]}"); then
      owner=$( [ -f "$STATE/$name.pid" ] && echo "started by slurm_local.sh" || echo "not started by slurm_local.sh")
      say "$name: running (pid $pid, $owner)"
    else
      say "$name: not running"
      rc=1
    fi
  done
  if command -v sinfo >/dev/null; then
    sinfo 2>&1 || rc=1
  else
    say "sinfo: not installed"
  fi
  return "$rc"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
