#!/usr/bin/env bash
# moegraph chat and run and Ctrl-C (SIGINT), as llama-cli takes it: during a
# chat's reply it stops that reply, not the program (the next line is the next
# turn, EOF then ends the chat with status 0); while the chat waits for a line
# it ends the program with its summary (status 130); a run stops at the next
# token and prints its summary (status 130).
# Usage: chat_interrupt_test.sh MOEGRAPH_BIN
set -euo pipefail
bin=$1
work=$(mktemp -d)
trap 'exec 3>&- 2>/dev/null || true; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; echo "--- stderr:" >&2; cat "$work/err" >&2; exit 1; }

# wait_for FILE PATTERN: until FILE holds PATTERN (30 s at most).
wait_for() {
  for _ in $(seq 300); do
    grep -q -- "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  fail "no '$2' in $1"
}

"$bin" make-fixture --arch qwen3moe --layers 2 --experts 4 --top-k 2 --embd 64 --ff 32 \
  -o "$work/chat.gguf" > /dev/null
# No -n and a large context: a reply runs until it is interrupted.
chat() {
  mkfifo "$work/in"
  "$bin" chat -m "$work/chat.gguf" --backend cpu --ctx 100000 < "$work/in" > "$work/out" \
    2> "$work/err" &
  pid=$!
  exec 3> "$work/in"
}

chat
echo "a reply that will not end" >&3
wait_for "$work/err" "backend cpu: "
sleep 1
kill -INT "$pid"
wait_for "$work/err" "turn 1: .*(interrupted)"
echo "and another" >&3
sleep 1
kill -INT "$pid"
wait_for "$work/err" "turn 2: .*(interrupted)"
exec 3>&-
status=0
wait "$pid" || status=$?
[[ $status == 0 ]] || fail "chat ended with status $status after EOF, not 0"
grep -q "generated" "$work/err" || fail "no summary line"

rm -f "$work/in"
chat
wait_for "$work/err" "backend cpu: "
kill -INT "$pid"
status=0
wait "$pid" || status=$?
exec 3>&-
[[ $status == 130 ]] || fail "Ctrl-C at the prompt ended the chat with status $status, not 130"
grep -q "generated" "$work/err" || fail "Ctrl-C at the prompt printed no summary"

"$bin" run -m "$work/chat.gguf" --backend cpu -p "a text that will not end" -n -1 --ctx 100000 \
  > "$work/out" 2> "$work/err" &
pid=$!
wait_for "$work/err" "backend cpu: "
sleep 1
kill -INT "$pid"
status=0
wait "$pid" || status=$?
[[ $status == 130 ]] || fail "Ctrl-C ended run with status $status, not 130"
grep -q "generated" "$work/err" || fail "Ctrl-C ended run without its summary"
echo "chat_interrupt_test: OK"
