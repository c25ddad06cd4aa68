#!/bin/sh
# The runtime every tauflow image shares, on either base (deploy/docker/Dockerfile):
#   runtime.sh PYTHON TORCH_VERSION
# - user and group tauflow (10001), unprivileged: the images run as it;
# - /var/lib/tauflow (state: queue log, checkpoints, run output) and /data (models and data sets),
#   owned by it, so that volumes mounted there start writable;
# - a virtual environment in /opt/tauflow/venv, owned by root (the code is not writable at run time);
# - /opt/tauflow/constraints.txt (PIP_CONSTRAINT): torch pinned, so that nothing installed later, a
#   reward plug-in say, can bring another torch.
set -eu
python=$1
torch_version=$2
groupadd --system --gid 10001 tauflow
useradd --system --uid 10001 --gid tauflow --home-dir /var/lib/tauflow --shell /usr/sbin/nologin tauflow
mkdir -p /var/lib/tauflow /data /etc/tauflow /opt/tauflow
chown tauflow:tauflow /var/lib/tauflow /data
echo "torch==${torch_version}" > /opt/tauflow/constraints.txt
"$python" -m venv "$VIRTUAL_ENV"
