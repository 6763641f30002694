//! Chat templates: the Jinja template in `tokenizer.chat_template`, rendered with `minijinja`
//! the way Hugging Face's `apply_chat_template` renders it.
use minijinja::{Environment, ErrorKind, context};
use serde::Serialize;

use crate::{Error, Result};

/// One turn of a conversation; `role` is "system", "user", "assistant" or "tool".
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders a chat template for `messages`. With `add_generation_prompt` the text ends with
/// the start of the assistant's turn. `bos_token`/`eos_token` are the texts templates refer
/// to by those names; `tools` is none.
pub fn apply_chat_template(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let err = |e: minijinja::Error| Error::Template(e.to_string());
    let mut env = Environment::new();
    // Hugging Face's Jinja environment trims blocks, and templates are written for that.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Python string methods (`.strip()`, `.startswith()`, `.split()`, …) that templates call.
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<(), minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    let tmpl = env.template_from_str(template).map_err(err)?;
    tmpl.render(context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        tools => (),
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_loops_conditions_and_generation_prompt() {
        let template = "{% for m in messages %}{% if loop.first and m.role != 'system' %}[sys]{% endif %}\
                        <{{ m.role }}>{{ m.content | trim }}\n{% endfor %}\
                        {% if add_generation_prompt %}<assistant>{% endif %}";
        let msgs = [
            Message::new("user", " hi "),
            Message::new("assistant", "yo"),
        ];
        assert_eq!(
            apply_chat_template(template, &msgs, true, "", "").unwrap(),
            "[sys]<user>hi\n<assistant>yo\n<assistant>"
        );
        assert_eq!(
            apply_chat_template(template, &msgs[..1], false, "", "").unwrap(),
            "[sys]<user>hi\n"
        );
    }

    #[test]
    fn blocks_are_trimmed_like_hugging_face() {
        // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it.
        let template = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        let msgs = [Message::new("user", "a"), Message::new("user", "b")];
        assert_eq!(
            apply_chat_template(template, &msgs, false, "", "").unwrap(),
            "a\nb\n"
        );
    }

    #[test]
    fn python_methods_special_tokens_and_tools() {
        let template = "{{ bos_token }}{% if tools %}T{% endif %}\
                        {% if messages[0]['content'].startswith('x') %}{{ messages[0].content.upper() }}{% endif %}\
                        {{ eos_token }}";
        let msgs = [Message::new("user", "xy")];
        assert_eq!(
            apply_chat_template(template, &msgs, false, "<s>", "</s>").unwrap(),
            "<s>XY</s>"
        );
    }

    #[test]
    fn template_errors_are_template_errors() {
        let msgs = [Message::new("user", "x")];
        let raised = apply_chat_template(
            "{{ raise_exception('no system role') }}",
            &msgs,
            false,
            "",
            "",
        );
        assert!(
            matches!(&raised, Err(Error::Template(m)) if m.contains("no system role")),
            "{raised:?}"
        );
        let unclosed = apply_chat_template("{% if true %}", &msgs, false, "", "");
        assert!(matches!(unclosed, Err(Error::Template(_))), "{unclosed:?}");
    }
}
