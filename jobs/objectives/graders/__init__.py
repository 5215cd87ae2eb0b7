"""Graders: rewards for sampled completions, named and shaped as OpenAI's reinforcement fine-tuning's.

``rewards.Graders`` runs a grader spec (jobs/spec/graders.py) over a step's completions; ``text`` holds
string_check and text_similarity, ``similarity`` text_similarity's metrics by their libraries, ``embeddings`` the
cosine metric's local encoder, ``wordnet`` meteor's WordNet, ``needs`` what a grader needs installed (checked at
submit), ``math_answer`` the math-verify grader, ``sandbox`` the python grader's subprocess, ``score_model`` the
local judge model, ``templates`` OpenAI's ``{{item.x}}`` / ``{{sample.output_text}}``.
"""

from jobs.objectives.graders.rewards import Graders
from jobs.objectives.graders.templates import render

__all__ = ["Graders", "render"]
