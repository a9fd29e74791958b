package PVE::Storage;

# Stand-in for Proxmox's PVE::Storage (pve-storage), for the plugin's tests only: the
# storage API version a Proxmox VE 9 host announces, and the parts of vdisk_free and
# vdisk_list that decide what an admin sees — a template that a linked clone names as
# its base is not deleted. Written from pve-storage's documented behaviour, not copied.
#
# Migration (t/40-migrate.t): the storage configuration (`config`, read from the JSON
# file FEWERBYTES_TEST_STORAGE_CFG names), and a small `storage_migrate` with the
# functions it calls, written here from what pve-storage does: pick the first format
# both sides offer, pipe `pvesm export` into `pvesm import` (t/bin/pvesm), take the
# volume ID the import prints. `load_pve_storage` replaces them with pve-storage's own
# code, read at test time from a pve-storage checkout (nothing of it is kept here).

use strict;
use warnings;

use JSON;
use PVE::Storage::Plugin;
use PVE::Tools qw(run_command);

# pve-storage's current storage API (its ApiChangeLog): version 15, compatible with
# the 6 before it.
use constant APIVER => 15;
use constant APIAGE => 6;

# "STORE:VOLNAME" -> (STORE, VOLNAME).
sub parse_volume_id {
    my ($volid) = @_;
    return ($1, $2) if $volid =~ m/^([a-z][a-z0-9\-_.]*[a-z0-9]):(.+)$/i;
    die "unable to parse volume ID '$volid'\n";
}

# Whether $volid is a template (base) volume that another volume on its storage names
# as its base, as Proxmox checks before freeing one.
sub volume_is_base_and_used {
    my ($plugin, $storeid, $scfg, $volid) = @_;
    my (undef, $volname) = parse_volume_id($volid);
    my (undef, $name, $vmid, undef, undef, $is_base) = $plugin->parse_volname($volname);
    return 0 if !$is_base;
    for my $info ($plugin->list_images($storeid, $scfg)->@*) {
        my (undef, $other) = parse_volume_id($info->{volid});
        my (undef, undef, undef, $basename, $basevmid) = eval { $plugin->parse_volname($other) };
        return 1 if $basename && defined($basevmid) && $basevmid == $vmid && $basename eq $name;
    }
    return 0;
}

# Free a volume as `qm destroy`, the GUI's "Remove" or `pvesm free` do.
sub vdisk_free {
    my ($plugin, $storeid, $scfg, $volid) = @_;
    my (undef, $volname) = parse_volume_id($volid);
    $plugin->activate_storage($storeid, $scfg, {});
    die "base volume '$volname' is still in use by linked clones\n"
        if volume_is_base_and_used($plugin, $storeid, $scfg, $volid);
    my (undef, undef, undef, undef, undef, $is_base, $format) = $plugin->parse_volname($volname);
    return $plugin->free_image($storeid, $scfg, $volname, $is_base, $format);
}

# ---------------------------------------------------------------------------------
# Migration

our $KNOWN_EXPORT_FORMATS = ['raw+size', 'tar+size', 'qcow2+size', 'vmdk+size', 'zfs', 'btrfs'];

sub config {
    my $file = $ENV{FEWERBYTES_TEST_STORAGE_CFG} // die "FEWERBYTES_TEST_STORAGE_CFG is not set\n";
    open(my $fh, '<', $file) or die "open $file: $!\n";
    local $/;
    return decode_json(<$fh>);
}

sub storage_config {
    my ($cfg, $storeid) = @_;
    return $cfg->{ids}->{$storeid} // die "storage '$storeid' does not exist\n";
}

my sub plugin_of {
    my ($cfg, $volid) = @_;
    my ($storeid, $volname) = parse_volume_id($volid);
    my $scfg = storage_config($cfg, $storeid);
    return (PVE::Storage::Plugin->lookup($scfg->{type}), $scfg, $storeid, $volname);
}

sub activate_volumes {
    my ($cfg, $vollist, $snapname) = @_;
    for my $volid (@$vollist) {
        my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
        $plugin->activate_volume($storeid, $scfg, $volname, $snapname, {});
    }
}

sub volume_snapshot {
    my ($cfg, $volid, $snap) = @_;
    my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
    return $plugin->volume_snapshot($scfg, $storeid, $volname, $snap);
}

sub volume_snapshot_delete {
    my ($cfg, $volid, $snap, $running) = @_;
    my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
    return $plugin->volume_snapshot_delete($scfg, $storeid, $volname, $snap, $running);
}

sub volume_export {
    my ($cfg, $fh, $volid, $format, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
    return $plugin->volume_export($scfg, $storeid, $fh, $volname, $format, $snapshot,
        $base_snapshot, $with_snapshots);
}

sub volume_import {
    my ($cfg, $fh, $volid, $format, $snapshot, $base_snapshot, $with_snapshots, $allow_rename) = @_;
    my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
    return $plugin->volume_import($scfg, $storeid, $fh, $volname, $format, $snapshot,
        $base_snapshot, $with_snapshots, $allow_rename) // $volid;
}

sub volume_export_formats {
    my ($cfg, $volid, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
    return $plugin->volume_export_formats($scfg, $storeid, $volname, $snapshot, $base_snapshot,
        $with_snapshots);
}

sub volume_import_formats {
    my ($cfg, $volid, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my ($plugin, $scfg, $storeid, $volname) = plugin_of($cfg, $volid);
    return $plugin->volume_import_formats($scfg, $storeid, $volname, $snapshot, $base_snapshot,
        $with_snapshots);
}

sub volume_imported_message {
    my ($volid, $want_pattern) = @_;
    return $want_pattern ? qr/successfully imported '([^']*)'$/ : "successfully imported '$volid'\n";
}

# Move $volid to storage $target_storeid on this node: the first format both offer,
# `pvesm export … | pvesm import …`, the new volume ID from the import's message.
sub storage_migrate {
    my ($cfg, $volid, $target_sshinfo, $target_storeid, $opts, $logfunc) = @_;
    die "this stand-in migrates on one node only\n" if defined($target_sshinfo);
    my ($storeid, $volname) = parse_volume_id($volid);
    my $target_volid = "$target_storeid:" . ($opts->{target_volname} // $volname);
    my @args = ('-with-snapshots', $opts->{with_snapshots} ? 1 : 0);
    push @args, '-snapshot', $opts->{snapshot} if defined($opts->{snapshot});
    my @base = defined($opts->{base_snapshot}) ? ('-base', $opts->{base_snapshot}) : ();
    my %import = map { $_ => 1 } volume_import_formats($cfg, $target_volid, $opts->{snapshot},
        $opts->{base_snapshot}, $opts->{with_snapshots});
    my ($format) = grep { $import{$_} } volume_export_formats($cfg, $volid, $opts->{snapshot},
        $opts->{base_snapshot}, $opts->{with_snapshots});
    die "cannot migrate '$volid' to storage '$target_storeid': no common format\n"
        if !defined($format);
    my $new_volid;
    my $pattern = volume_imported_message(undef, 1);
    run_command(
        [
            ['pvesm', 'export', $volid, $format, '-', @args, @base],
            ['pvesm', 'import', $target_volid, $format, '-', @args,
                '-allow-rename', $opts->{allow_rename} ? 1 : 0, @base],
        ],
        logfunc => sub {
            $new_volid = $1 if $_[0] =~ $pattern;
            $logfunc->($_[0]) if $logfunc;
        },
    );
    die "unable to get ID of the migrated volume\n" if !defined($new_volid);
    return $new_volid;
}

# Replace the migration functions above by pve-storage's own, read from
# src/PVE/Storage.pm of the checkout $dir names (nothing of it is kept in this
# repository). Returns the names of the functions loaded.
sub load_pve_storage {
    my ($dir) = @_;
    my $file = "$dir/src/PVE/Storage.pm";
    open(my $fh, '<', $file) or die "open $file: $!\n";
    my $source = do { local $/; <$fh> };
    my @code;
    for my $closure (qw(volname_for_storage volume_import_prepare volume_export_prepare)) {
        $source =~ m/^(my \$$closure = sub \{.*?^\};\n)/ms
            or die "$file has no \$$closure\n";
        push @code, $1;
    }
    my @subs = qw(storage_migrate_snapshot storage_migrate volume_export volume_import
        volume_export_formats volume_import_formats volume_transfer_formats
        volume_imported_message);
    for my $sub (@subs) {
        $source =~ m/^(sub \Q$sub\E\b.*?^\}\n)/ms or die "$file has no sub $sub\n";
        push @code, $1;
    }
    my $code = "package PVE::Storage; use strict; use warnings; no warnings qw(redefine prototype);"
        . " use Socket qw(SOCK_STREAM); use PVE::Tools qw(run_command);\n"
        . join("\n", @code) . "\n1;\n";
    eval $code or die "pve-storage's functions from $file do not load here: $@";
    return @subs;
}

1;
