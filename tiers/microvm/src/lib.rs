//! Strata's microVM tier (work in progress).
