//! The bearer token of a request, from its `Authorization` header (RFC 6750 §2.1), or why
//! there is none. Whatever the caller sent is hostile: it is read only as far as needed,
//! bounded in length and character set, and never logged.

use axum::http::{HeaderMap, header};

/// The longest token sent for review. A ServiceAccount token is about 1 KiB; cloud and OIDC
/// tokens stay well under this.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// Why a request carries no usable token (the body of its 401).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// No `Authorization` header.
    NoHeader,
    /// More than one `Authorization` header: which one counts would be a guess.
    Ambiguous,
    /// Another scheme than `Bearer`, or no token after it.
    NotBearer,
    /// Longer than [`MAX_TOKEN_BYTES`].
    TooLong,
    /// A character RFC 6750's `b64token` does not allow (spaces, controls, non-ASCII).
    Malformed,
}

impl Missing {
    pub fn describe(self) -> &'static str {
        match self {
            Missing::NoHeader => "no bearer token (Authorization: Bearer <token>)",
            Missing::Ambiguous => "more than one Authorization header",
            Missing::NotBearer => "the Authorization header is not a Bearer token",
            Missing::TooLong => "the bearer token is too long",
            Missing::Malformed => "the bearer token has characters a token cannot have",
        }
    }
}

/// The token of `Authorization: Bearer <token>` (the scheme in any case).
pub fn token(headers: &HeaderMap) -> Result<&str, Missing> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next().ok_or(Missing::NoHeader)?;
    if values.next().is_some() {
        return Err(Missing::Ambiguous);
    }
    // Checked before anything else is done with it: a 60 KiB header is not scanned twice.
    if value.len() > MAX_TOKEN_BYTES + "Bearer ".len() + 16 {
        return Err(Missing::TooLong);
    }
    let value = value.to_str().map_err(|_| Missing::Malformed)?;
    let (scheme, rest) = value.split_once(' ').ok_or(Missing::NotBearer)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(Missing::NotBearer);
    }
    let token = rest.trim_matches(' ');
    if token.is_empty() {
        return Err(Missing::NotBearer);
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(Missing::TooLong);
    }
    if !is_b64token(token) {
        return Err(Missing::Malformed);
    }
    Ok(token)
}

/// RFC 6750: `1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`.
fn is_b64token(t: &str) -> bool {
    let body = t.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with(values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::AUTHORIZATION, HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    #[test]
    fn a_bearer_token_is_taken_in_any_case_of_the_scheme() {
        let jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln";
        for v in [
            format!("Bearer {jwt}"),
            format!("bearer {jwt}"),
            format!("BEARER  {jwt} "),
        ] {
            assert_eq!(token(&with(&[v.as_bytes()])), Ok(jwt), "{v}");
        }
        // EKS' IAM tokens and padded base64 are tokens too.
        assert_eq!(
            token(&with(&[b"Bearer k8s-aws-v1.aHR0cHM6Ly9zdHM_=="])),
            Ok("k8s-aws-v1.aHR0cHM6Ly9zdHM_==")
        );
    }

    #[test]
    fn what_an_attacker_sends_instead_of_a_token_is_named_not_reviewed() {
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        let huge = format!("Bearer {}", "a".repeat(60 * 1024));
        let cases: Vec<(HeaderMap, Missing)> = vec![
            (HeaderMap::new(), Missing::NoHeader),
            (with(&[b"Bearer a", b"Bearer b"]), Missing::Ambiguous),
            (with(&[b"Basic dXNlcjpwYXNz"]), Missing::NotBearer),
            (with(&[b"Bearer"]), Missing::NotBearer),
            (with(&[b"Bearer    "]), Missing::NotBearer),
            (with(&[b"Bearertoken"]), Missing::NotBearer),
            (with(&[long.as_bytes()]), Missing::TooLong),
            (with(&[huge.as_bytes()]), Missing::TooLong),
            (with(&[b"Bearer a b"]), Missing::Malformed),
            (with(&[b"Bearer a\tb"]), Missing::Malformed),
            (with(&[b"Bearer ===="]), Missing::Malformed),
            (with(&[b"Bearer a=b"]), Missing::Malformed),
            (with(&[b"Bearer tok\xc3\xa9n"]), Missing::Malformed),
            (with(&[b"Bearer a,b"]), Missing::Malformed),
        ];
        for (headers, want) in cases {
            // (the header itself may be 60 KiB: only its start is shown)
            let shown: Vec<String> = headers
                .get_all(header::AUTHORIZATION)
                .iter()
                .map(|v| String::from_utf8_lossy(&v.as_bytes()[..v.len().min(24)]).into())
                .collect();
            assert_eq!(token(&headers), Err(want), "{shown:?}");
        }
    }
}
