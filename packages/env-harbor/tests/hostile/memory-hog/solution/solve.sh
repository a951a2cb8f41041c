#!/bin/bash
python3 -c 'x = [bytearray(2**20) for _ in range(1024)]' && echo "allocated 1 GiB" > /app/breach
exit 0
