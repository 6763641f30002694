//! Stop strings: generated text is released only once it cannot be part of a stop string, so
//! a stop string split over tokens is never emitted, nor anything after it.

/// The text of one sequence between its decoder and its events.
pub struct StopText {
    stops: Vec<String>,
    /// Released by the decoder, not yet emitted: the longest tail that begins a stop string.
    held: String,
}

impl StopText {
    /// `stops` must not hold an empty string (it would match everywhere).
    pub fn new(stops: Vec<String>) -> StopText {
        StopText {
            stops,
            held: String::new(),
        }
    }

    /// Takes the next piece of text (whole characters) and returns what can be emitted now and
    /// whether a stop string is complete; if it is, the text from its start on is dropped
    /// (the earliest, when several are).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let found = self.stops.iter().filter_map(|s| self.held.find(s.as_str()));
        if let Some(at) = found.min() {
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        // Nothing before the first character where a stop string may begin can be part of one.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let tail = self.held.split_off(keep);
        (std::mem::replace(&mut self.held, tail), false)
    }

    /// At the end of the sequence: the held text, with the decoder's last bytes (`rest`) passed
    /// through the matcher first.
    pub fn finish(mut self, rest: &str) -> String {
        let (mut text, stopped) = self.push(rest);
        if !stopped {
            text.push_str(&self.held);
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> StopText {
        StopText::new(s.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn a_stop_string_split_over_pieces_is_never_emitted() {
        let mut st = stops(&["\n\nUser:"]);
        assert_eq!(st.push("Hello"), ("Hello".into(), false));
        assert_eq!(st.push(" there.\n"), (" there.".into(), false));
        assert_eq!(st.push("\nUs"), ("".into(), false));
        assert_eq!(st.push("er: next"), ("".into(), true));
    }

    #[test]
    fn held_text_is_released_when_it_cannot_begin_a_stop() {
        let mut st = stops(&["abc"]);
        assert_eq!(st.push("xa"), ("x".into(), false));
        assert_eq!(st.push("b"), ("".into(), false));
        // No tail of "abd" begins "abc": all of it goes.
        assert_eq!(st.push("d"), ("abd".into(), false));
        // "aab": the first "a" cannot begin it, "ab" can.
        assert_eq!(st.push("aab"), ("a".into(), false));
        assert_eq!(st.finish("!"), "ab!");
    }

    #[test]
    fn the_earliest_stop_wins_and_drops_the_rest() {
        let mut st = stops(&["world", "lo w"]);
        assert_eq!(st.push("hello world"), ("hel".into(), true));
        let mut st = stops(&["END"]);
        assert_eq!(st.push("aENDbEND"), ("a".into(), true));
    }

    #[test]
    fn text_is_held_and_cut_at_character_boundaries() {
        // The stop begins with the second byte sequence of a two-character string: "é" must
        // not be split, and is released whole once the stop cannot follow.
        let mut st = stops(&["€x"]);
        assert_eq!(st.push("é€"), ("é".into(), false));
        assert_eq!(st.push("y"), ("€y".into(), false));
        assert_eq!(st.push("日€"), ("日".into(), false));
        assert_eq!(st.push("x"), ("".into(), true));
    }

    #[test]
    fn finish_matches_the_last_bytes_too() {
        let mut st = stops(&["ab"]);
        assert_eq!(st.push("xa"), ("x".into(), false));
        assert_eq!(st.finish("b"), "");
        let st = stops(&[]);
        assert_eq!(st.finish("\u{fffd}"), "\u{fffd}");
    }
}
