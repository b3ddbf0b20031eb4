//! A tenant as a record keeps it: a hashed tenant's hex hash as bytes.

use std::collections::HashMap;

use idem_core::StoreError;
use redis::Value;

use super::{bytes, text};
use crate::{errors::corrupt, format as f};

/// A tenant as the record keeps it: `("tenant", tenant)`, or, for a tenant
/// that ends in a 64-digit lower-case hex hash (every hashed tenant of
/// the layer and the gateway), `("tenant_bin", prefix + the hash's 32
/// bytes)`: 69 characters become 37 bytes, within the 64 bytes of Redis'
/// compact hash encoding.
pub(crate) fn encode_tenant(tenant: &str) -> (&'static str, Vec<u8>) {
    let form = TenantForm::of(tenant);
    (form.field(), form.pieces().concat())
}

/// A tenant as [`encode_tenant`] keeps it, without a copy: its field and
/// the pieces of its value.
pub(crate) struct TenantForm<'a> {
    /// The tenant, or the prefix before its hash.
    text: &'a [u8],
    /// The hash's bytes, when the tenant ends in one.
    hash: Option<[u8; 32]>,
}

/// A tenant text and its hash's bytes, when it ends in one.
type EncodedTenant = (std::sync::Arc<str>, Option<[u8; 32]>);

thread_local! {
    /// The tenant this thread encoded last, kept alive, with its hash's
    /// bytes: one caller's requests share one tenant text (the layer's
    /// extractors hand out one `Arc` per caller), so its hex is decoded
    /// once per run of that caller's requests on the thread, not per
    /// request. Holding the `Arc` keeps its text from being freed and
    /// replaced, so the same pointer means the same text.
    static LAST_TENANT: std::cell::RefCell<Option<EncodedTenant>> =
        const { std::cell::RefCell::new(None) };
}

impl<'a> TenantForm<'a> {
    /// [`of`](Self::of) for a shared tenant text: the hash of the text this
    /// thread encoded last is reused when `tenant` is that very text.
    pub(crate) fn of_shared(tenant: &'a std::sync::Arc<str>) -> Self {
        let reused = LAST_TENANT
            .try_with(|last| match &*last.borrow() {
                Some((text, hash)) if std::sync::Arc::ptr_eq(text, tenant) => Some(*hash),
                _ => None,
            })
            .ok()
            .flatten();
        if let Some(hash) = reused {
            let bytes = tenant.as_bytes();
            let text = match hash {
                Some(_) => &bytes[..bytes.len() - 64],
                None => bytes,
            };
            return Self { text, hash };
        }
        let form = Self::of(tenant);
        // A thread past its thread-locals' end keeps nothing.
        let _ = LAST_TENANT.try_with(|last| {
            *last.borrow_mut() = Some((std::sync::Arc::clone(tenant), form.hash));
        });
        form
    }

    pub(crate) fn of(tenant: &'a str) -> Self {
        /// Each byte's value as a lower-case hex digit, or 0x10 when it is
        /// none: an upper-case digit would not read back as written.
        const NIBBLES: [u8; 256] = {
            let mut table = [0x10u8; 256];
            let mut digit = 0;
            while digit < 16 {
                table[b"0123456789abcdef"[digit] as usize] = digit as u8;
                digit += 1;
            }
            table
        };
        // Every pair looked up without a branch; one check at the end.
        fn decode(hex: &[u8]) -> Option<[u8; 32]> {
            let mut hash = [0u8; 32];
            let mut seen = 0u8;
            for (byte, pair) in hash.iter_mut().zip(hex.chunks_exact(2)) {
                let (high, low) = (NIBBLES[usize::from(pair[0])], NIBBLES[usize::from(pair[1])]);
                seen |= high | low;
                *byte = high << 4 | low;
            }
            (seen < 0x10).then_some(hash)
        }
        let bytes = tenant.as_bytes();
        if let Some(split) = bytes.len().checked_sub(64) {
            let (prefix, hex) = bytes.split_at(split);
            if let Some(hash) = decode(hex) {
                return Self {
                    text: prefix,
                    hash: Some(hash),
                };
            }
        }
        Self {
            text: bytes,
            hash: None,
        }
    }

    /// `tenant` or `tenant_bin`.
    pub(crate) fn field(&self) -> &'static str {
        if self.hash.is_some() {
            f::TENANT_BIN
        } else {
            f::TENANT
        }
    }

    /// The field's value, in two pieces.
    pub(crate) fn pieces(&self) -> [&[u8]; 2] {
        [
            self.text,
            self.hash.as_ref().map_or(&[][..], |hash| &hash[..]),
        ]
    }
}

/// Reads back what [`encode_tenant`] wrote.
pub(super) fn decode_tenant(fields: &HashMap<String, &Value>) -> Result<String, StoreError> {
    if let Some(value) = fields.get(f::TENANT) {
        return text(value);
    }
    let raw = bytes(
        fields
            .get(f::TENANT_BIN)
            .ok_or_else(|| corrupt("record lacks tenant"))?,
    )?;
    let split = raw
        .len()
        .checked_sub(32)
        .ok_or_else(|| corrupt("short tenant"))?;
    let prefix = std::str::from_utf8(&raw[..split]).map_err(|_| corrupt("tenant prefix"))?;
    let mut tenant = String::with_capacity(prefix.len() + 64);
    tenant.push_str(prefix);
    idem_core::push_hex(&mut tenant, &raw[split..]);
    Ok(tenant)
}
