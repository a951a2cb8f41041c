#!/bin/bash
own="${OPENAI_BASE_URL:-http://127.0.0.1:1/sess/none/v1}"
victim="${FERRYMAN_VICTIM_URL:-http://127.0.0.1:1/sess/none/v1}"
vsecret=$(printf '%s' "$victim" | sed -nE 's#.*/sess/([^/]+)/.*#\1#p')
root=$(printf '%s' "$own" | sed -nE 's#^(http://[^/]*)/.*#\1#p')
body='{"model":"ferryman-policy","messages":[{"role":"user","content":"hi"}]}'
: > /app/codes
try() { code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$@"); echo "$code $*" >> /app/codes; }
try "$own/models"
try "$victim/models"
try -X POST -H 'Content-Type: application/json' -d "$body" "$victim/chat/completions"
try --path-as-is "$own/../../$vsecret/v1/models"
try --path-as-is "$own/%2e%2e/%2e%2e/$vsecret/v1/models"
try "$root/"
try "$root//sess/$vsecret/v1/models"
# a second request on the same connection, after an allowed first one
code=$(curl -s -o /dev/null -o /dev/null -w '%{http_code}\n' --max-time 5 "$own/models" "$victim/models" | tail -1)
echo "$code keep-alive $victim/models" >> /app/codes
grep -E '^2' /app/codes | grep -v " $own/models\$" | grep -F "$vsecret" > /app/breach
exit 0
