"""Stand-in for transformers' ``tests/utils/test_configuration_utils.py`` (not in the sdist).

``ConfigTester.check_config_arguments_init`` imports ``config_common_kwargs`` from it: one non-default value for
every attribute that ``PreTrainedConfig`` (transformers 5) itself defines, so that the test sees each of them
reach the model's config through ``__init__``. The real module also tests the hub (push, remote configs), which
needs credentials and the network; only this dictionary is needed here. The values are the real module's for the
keys transformers 5 still has; ``test_config_common_kwargs_are_base_attributes`` in
``tests/test_transformers_common.py`` checks the keys against the installed ``PreTrainedConfig``.
"""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
