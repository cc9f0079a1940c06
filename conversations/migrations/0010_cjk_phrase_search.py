"""Find a Chinese, Japanese or Korean phrase inside a sentence (R-ADM-3).

PostgreSQL's parser keeps a run of CJK characters between punctuation as one
word, so ``深度检索`` inside ``请使用深度检索工具`` was not found. The
``search_vector`` column (migration ``0004_audit_search``) is rebuilt from
the same parts passed through ``audit_search_text``: each run of CJK
characters (Han, kana, Hangul) stands apart from the letters around it and
is written as its overlapping bigrams, ``请使 使用 用深 深度 度检 检索 索工
工具``, in order. The search (``audit.reads.search.search_text``) writes a
CJK term of the query the same way, as a phrase of its bigrams: the phrase
matches wherever the term is inside a run, and only in that order. Text
without CJK characters is unchanged, so is its vector.

Bigrams triple a CJK text's length: after the transform the content is cut
at 120,000 characters and the tool input and tool calls at 20,000 each (the
cut before it, 60,000 and 10,000, stays), so that a row of distinct
bigrams stays under the 1 MB ``tsvector`` limit (~750 kB at worst) and never
fails its audit write.

Dropping and adding the generated column rewrites the table once and
computes every existing row's vector; the GIN index is rebuilt. No row
trigger runs (the append-only audit triggers are row triggers). The rewrite
holds an ACCESS EXCLUSIVE lock on the message table until it ends: on a
large audit, run it when runs can wait (as any table rewrite).
"""

from django.db import migrations

# Han (CJK unified ideographs, extension A, B and later, compatibility),
# 々 and 〇, hiragana, katakana (and its extensions, half-width forms),
# Hangul syllables and jamo. audit.reads.search.CJK_CHARACTERS is the same
# class (a test compares both transforms).
CJK = (
    r"\u1100-\u11ff\u3005\u3007\u3040-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    r"\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f\U00020000-\U0002ffff"
)

# Two passes: a space around each CJK run (it is no part of a Latin word
# next to it), then each character inside a run (a CJK character before
# and after it) doubled with a space between: ABCD -> AB BC CD.
SEARCH_TEXT_FUNCTION = f"""
CREATE FUNCTION audit_search_text(value text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT regexp_replace(
        regexp_replace(value, '([{CJK}]+)', ' \\1 ', 'g'),
        '(?<=[{CJK}])([{CJK}])(?=[{CJK}])', '\\1 \\1', 'g')
$$;
"""

BIGRAM_VECTOR = """
DROP INDEX IF EXISTS message_search_idx;
ALTER TABLE conversations_message DROP COLUMN search_vector;
ALTER TABLE conversations_message ADD COLUMN search_vector tsvector GENERATED ALWAYS AS (
    to_tsvector(
        'simple'::regconfig,
        left(audit_search_text(left(coalesce(content, ''), 60000)), 120000) || ' '
        || audit_search_text(coalesce(tool_name, '')) || ' '
        || left(audit_search_text(left(coalesce(tool_input::text, ''), 10000)), 20000) || ' '
        || left(audit_search_text(left(coalesce(tool_calls::text, ''), 10000)), 20000)
    )
) STORED;
CREATE INDEX message_search_idx ON conversations_message USING gin (search_vector);
"""

# The vector of 0004_audit_search.
WORD_VECTOR = """
DROP INDEX IF EXISTS message_search_idx;
ALTER TABLE conversations_message DROP COLUMN search_vector;
ALTER TABLE conversations_message ADD COLUMN search_vector tsvector GENERATED ALWAYS AS (
    to_tsvector(
        'simple'::regconfig,
        left(coalesce(content, ''), 60000) || ' ' || coalesce(tool_name, '') || ' '
        || left(coalesce(tool_input::text, ''), 10000) || ' ' || left(coalesce(tool_calls::text, ''), 10000)
    )
) STORED;
CREATE INDEX message_search_idx ON conversations_message USING gin (search_vector);
DROP FUNCTION audit_search_text(text);
"""


def bigram_vector(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SEARCH_TEXT_FUNCTION)
        schema_editor.execute(BIGRAM_VECTOR)


def word_vector(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(WORD_VECTOR)


class Migration(migrations.Migration):
    dependencies = [
        ("conversations", "0009_message_effect_ledger"),
    ]

    operations = [
        migrations.RunPython(bigram_vector, word_vector, elidable=False),
    ]
