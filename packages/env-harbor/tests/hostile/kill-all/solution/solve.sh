#!/bin/bash
kill -9 -1
# the caller survives kill(-1); anything else it reached is the breach
n=$(ls -d /proc/[0-9]* | wc -l)
if [ -e /proc/2 ] && [ "$n" -gt 10 ]; then echo "saw $n processes after kill -9 -1" > /app/breach; fi
exit 0
