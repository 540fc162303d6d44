#!/usr/bin/env bash
# The quickstart split into separate miles-node processes against one nats-server:
# a controller, two rollout workers and a trainer with two ranks (gloo), as on several machines.
#   bash benchmarks/split_run.sh [RUN_DIR]
# Prints the run's summary.json; compare with `miles run recipes/quickstart.yaml`.
set -euo pipefail
RUN_DIR=${1:-runs/split}
RECIPE=recipes/quickstart.yaml
rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR"
miles bus --run-dir "$RUN_DIR" > "$RUN_DIR/bus.url" 2> "$RUN_DIR/bus.log" &
BUS=$!
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -s "$RUN_DIR/bus.url" ] && break; sleep 0.2; done
URL=$(head -n1 "$RUN_DIR/bus.url")
echo "nats-server at $URL"
common=(-c "$RECIPE" --set trainer.ranks=2 --run-dir "$RUN_DIR" --nats-url "$URL")
miles-node --role controller "${common[@]}" --actor-id controller > "$RUN_DIR/controller.log" 2>&1 &
CTRL=$!
for i in 0 1; do
  miles-node --role rollout "${common[@]}" --actor-id "rollout-$i" > "$RUN_DIR/rollout-$i.log" 2>&1 &
done
for rank in 0 1; do
  miles-node --role trainer "${common[@]}" --rank $rank --world-size 2 --master-port 29533 \
      --actor-id "trainer-$rank" > "$RUN_DIR/trainer-$rank.log" 2>&1 &
done
wait $CTRL
sleep 3
kill $BUS
cat "$RUN_DIR/summary.json"
