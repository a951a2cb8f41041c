#!/bin/bash
# reward 1 only for the right answer, which the agent cannot know
if [ "$(cat /app/answer 2>/dev/null)" = "$(cat /tests/expected)" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
