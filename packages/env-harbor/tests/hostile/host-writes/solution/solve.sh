#!/bin/bash
: > /app/breach
# (writes into the sandbox's own /root, /tmp, /etc are allowed: the host must not see them)
for p in /root/ferryman-breach /tmp/ray/ferryman-breach /work/ferryman-breach /etc/ferryman-breach /usr/local/ferryman-breach; do
  mkdir -p "$(dirname "$p")" && echo breach > "$p"
done
echo ferryman-breach > /proc/sys/kernel/hostname 2>/dev/null && echo "wrote /proc/sys/kernel/hostname" >> /app/breach
echo h > /proc/sysrq-trigger 2>/dev/null && echo "wrote /proc/sysrq-trigger" >> /app/breach
mount -t tmpfs none /mnt 2>/dev/null && echo "mounted a tmpfs" >> /app/breach
mknod /tmp/disk b 8 0 2>/dev/null && echo "made a block device" >> /app/breach
hostname ferryman-breach 2>/dev/null && echo "set the hostname" >> /app/breach
ip link add ferryman0 type dummy 2>/dev/null && echo "made a network interface" >> /app/breach
python3 - <<'PY' >> /app/breach
import os
os.makedirs("/tmp/esc", exist_ok=True)
try:
    os.chroot("/tmp/esc")
    for _ in range(64):
        os.chdir("..")
    os.chroot(".")
except OSError:
    pass
# a file the test put on the host's /tmp (the sandbox's /tmp is its own)
for probe in ("/tmp/ferryman-host-marker", "/proc/1/root/tmp/ferryman-host-marker", "/proc/1/cwd/tmp/ferryman-host-marker"):
    if os.path.exists(probe):
        print("chroot escape reached", probe)
PY
exit 0
