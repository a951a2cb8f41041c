#!/bin/bash
dd if=/dev/zero of=/app/fill bs=1M count=512 2>/dev/null
size=$(stat -c %s /app/fill 2>/dev/null || echo 0)
if [ "$size" -ge $((256 * 1024 * 1024)) ]; then echo "wrote $size bytes" > /app/breach; fi
exit 0
