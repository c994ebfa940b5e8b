#!/usr/bin/env bash
# A one-node Slurm for the tests (no systemd): munged, slurmctld and slurmd started by hand.
#   apt-get install -y slurm-wlm munge && bash tests/scripts/start_slurm.sh
# The node declares SLURM_TEST_CPUS CPUs (default 8) whatever the machine has
# (SlurmdParameters=config_overrides), so srun can place 3 tasks on 2 cores.
set -euo pipefail
cpus="${SLURM_TEST_CPUS:-8}"
host="$(hostname -s)"
if scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %T 2>/dev/null | grep -qv down; then
  echo "start_slurm: already running"; exit 0
fi
mkdir -p /etc/munge /var/log/munge /run/munge /var/lib/munge /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /var/log/munge /run/munge /var/lib/munge 2>/dev/null || true
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
# The settings tests/scripts/slurm_box.py's 3-node box shares, then this machine's paths and node.
{
  echo "ClusterName=tfdp"
  echo "SlurmctldHost=${host}"
  cat "$(dirname "$0")/slurm_settings.conf"
  cat <<CONF
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=${host} CPUs=${cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
} > /etc/slurm/slurm.conf
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then
    echo "start_slurm: node ${host} up with ${cpus} CPUs"; exit 0
  fi
  scontrol update nodename="${host}" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "start_slurm: the node did not come up; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
