#!/usr/bin/env bash
# Commit the token store as it is now: a snapshot of the manifest and exactly the shards it
# lists (a running datagen may list more meanwhile; they go in the next commit).
set -euo pipefail
cd "$(dirname "$0")/.."
snap=$(mktemp); cp data/train/manifest.json "$snap"
mapfile -t shards < <(python3 -c "import json,sys; [print('data/train/' + e['name']) for e in json.load(open(sys.argv[1]))['shards']]" "$snap")
git add "${shards[@]}"
blob=$(git hash-object -w "$snap"); rm -f "$snap"
git update-index --cacheinfo 100644 "$blob" data/train/manifest.json
git commit -q -m "${1:-data/train: more target answers}"
git log --oneline -1
