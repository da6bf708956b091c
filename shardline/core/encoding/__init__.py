"""The encoding: raw rows -> the arrays stored in shards, the same for training and for serving.

One module a concept:
- `columns`: the rules for columns and the sequence/order columns every row gets (`prepare`), `DataError`;
- `contract`: what the config decides about the encoding, its hash, and what differs between two;
- `splits`: which rows go to train, validation and test (a seeded hash of the sequence, or value ranges);
- `fit`: the data set's encoding from every file group's training statistics;
- `group`: the encode step's one-pass encoder of a file group into its shards, in the group's own codes;
- `frame`: the serving encoder of prepared rows in the data set's encoding (the registered model's);
- `text`: text data (`data.features.text`): the tokenizer and the token streams (docs/model-contract.md, Text).

How a shard's own codes map to the data set's encoding at read time: `shardline/core/codes.py`.

Rules (docs/data-and-shards.md):
- continuous: (x - mean) / std with mean/std of the training split; null and NaN become the
  training mean (0 after standardisation); a constant column (std 0) gets std 1.
- boolean: 0 = null, 1 = false, 2 = true (an id in the `cat` array, embedded like a categorical).
- categorical: values compared as strings; id 0 is reserved for values unseen in training and
  for null; ids 1.. follow the training frequency (most frequent first, ties by value).
- target: classification as a vocabulary (id 0 = a class never seen in training); regression
  standardised like a continuous column. A null target is an error, never silently dropped.
"""
