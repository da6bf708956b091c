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

The rules of each column kind (standardised continuous values, vocabularies with id 0 for unseen values and
null, boolean ids, a null target refused): docs/data-and-shards.md, "The encoding".
"""
