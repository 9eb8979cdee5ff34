"""The rules that score one response: :mod:`.math_reward` (answer extraction in
:mod:`.answer_extraction`, comparison in :mod:`.math_grader`), :mod:`.code_reward` (run in the
sandbox) and :mod:`.llm_judge`; all return a :class:`.result.RewardResult`."""
